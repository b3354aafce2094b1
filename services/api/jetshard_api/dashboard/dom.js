// Building elements from data without ever parsing it as HTML: every string becomes a text node.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "className") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

export function badge(text, tone) {
  return el("span", { className: `badge badge-${tone}` }, text);
}

// A bar filled to `fraction` (0..1); the width is set through the CSSOM, which the page's policy allows.
export function bar(fraction, tone = "accent") {
  const fill = el("span", { className: `bar-fill bar-${tone}` });
  fill.style.width = `${Math.round(Math.min(1, Math.max(0, fraction)) * 1000) / 10}%`;
  return el("span", { className: "bar", role: "presentation" }, fill);
}

const UNITS = ["B", "KB", "MB", "GB", "TB"];

export function size(bytes) {
  let value = bytes;
  let unit = 0;
  while (value >= 1000 && unit < UNITS.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 || value >= 100 ? 0 : 1)} ${UNITS[unit]}`;
}

export function percent(done, total) {
  return total ? `${Math.floor((100 * done) / total)}%` : "–";
}

export function duration(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

export function clock(atMs) {
  return new Date(atMs).toLocaleTimeString([], { hour12: false });
}

// A button for one of the page's actions (see manage.js): `label`, its accessible name, names what it acts on
// ("Place org/model"), while `text` is what it shows; `data-ids` carries the ids the action needs (one attribute
// of its own, so a button never matches what selects the element it sits in, like `[data-node-id]`).
export function actionButton(text, label, action, ids = {}, tone = "quiet") {
  const dataset = { action, ids: JSON.stringify(ids) };
  return el("button", { type: "button", className: `action ${tone}`, "aria-label": label, dataset }, text);
}

// The element under `root` with this accessible name, if one is still there (after a rebuild or a dialog).
export function labelled(root, label) {
  return [...root.querySelectorAll("[aria-label]")].find((node) => node.getAttribute("aria-label") === label) ?? null;
}
