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
// ("Place org/model") and holds `text`, what it shows (so a voice user can say what they see). `data-ids`
// carries the ids the action needs, in one attribute of its own, so a button never matches what selects the
// element it sits in (like `[data-node-id]`).
export function actionButton(text, label, action, ids = {}, tone = "quiet") {
  const dataset = { action, ids: JSON.stringify(ids) };
  return el("button", { type: "button", className: `action ${tone}`, "aria-label": label, dataset }, text);
}

// The element under `root` with this accessible name, if one is still there (after a rebuild or a dialog).
export function labelled(root, label) {
  return [...root.querySelectorAll("[aria-label]")].find((node) => node.getAttribute("aria-label") === label) ?? null;
}

// What identifies an element among its siblings from one view to the next: the control's name, or the id of
// the node, model, instance, task or directory it shows.
function keyOf(node) {
  if (node.nodeType !== Node.ELEMENT_NODE) return null;
  const ids = node.dataset;
  const key = node.getAttribute("aria-label") ?? ids.nodeId ?? ids.modelId ?? ids.instanceId ?? ids.taskId ?? ids.path;
  return key === undefined ? null : `${node.nodeName} ${key}`;
}

// `current` changed in place to look like `wanted` where both are the same kind of element; else `wanted`.
function morph(current, wanted) {
  if (current.nodeName !== wanted.nodeName) return wanted;
  if (current.nodeType === Node.TEXT_NODE) {
    if (current.data !== wanted.data) current.data = wanted.data;
    return current;
  }
  for (const { name } of [...current.attributes]) if (!wanted.hasAttribute(name)) current.removeAttribute(name);
  for (const { name, value } of wanted.attributes) {
    if (current.getAttribute(name) === value) continue;
    // Through the CSSOM: the page's policy refuses style attributes set as text.
    if (name === "style") current.style.cssText = wanted.style.cssText;
    else current.setAttribute(name, value);
  }
  morphChildren(current, [...wanted.childNodes]);
  return current;
}

// Makes `parent`'s children look like `wanted` by changing only what differs: an element that stays (the
// button under the pointer, the focused one) is the same element afterwards, so a rebuild every quarter second
// never swallows a click or loses a keyboard user's place.
export function morphChildren(parent, wanted) {
  const current = [...parent.childNodes];
  const keyed = new Map(current.filter((n) => keyOf(n) !== null).map((n) => [keyOf(n), n]));
  const unkeyed = current.filter((n) => keyOf(n) === null);
  const kept = wanted.map((node) => {
    const key = keyOf(node);
    const match = key === null ? unkeyed.shift() : keyed.get(key);
    keyed.delete(key);
    return match ? morph(match, node) : node;
  });
  kept.forEach((node, i) => {
    if (parent.childNodes[i] !== node) parent.insertBefore(node, parent.childNodes[i] ?? null);
  });
  while (parent.childNodes.length > kept.length) parent.lastChild.remove();
}
