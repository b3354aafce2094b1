// The live event log: one line per event, newest first, the oldest dropped past a bound.

import { clock, el } from "./dom.js";

const KEPT_LINES = 200;
const list = () => document.getElementById("events");

export function clearEvents() {
  list().replaceChildren();
}

export function addEvent(line) {
  const item = el(
    "li",
    { dataset: { seq: line.seq, type: line.type } },
    el("time", { datetime: new Date(line.at_ms).toISOString(), title: `event ${line.seq}` }, clock(line.at_ms)),
    el("span", { className: "line" }, el("span", { className: "type" }, line.type), " ", line.gist),
  );
  const events = list();
  events.prepend(item);
  while (events.childElementCount > KEPT_LINES) events.lastElementChild.remove();
}
