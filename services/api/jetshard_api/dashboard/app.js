// The dashboard: the live view with its actions, the event log and the chat box, and the API key the page sends.

import { apiKey, setApiKey } from "./api.js";
import { setReadyModels, startChat } from "./chat.js";
import { addEvent, clearEvents } from "./events.js";
import { followView } from "./live.js";
import { setImportNodes, showImports, startManaging } from "./manage.js";
import { renderView } from "./view.js";

const CONNECTION = {
  live: ["live", "good"],
  down: ["disconnected", "bad"],
  key: ["API key needed", "bad"],
};

function showConnection(state, detail) {
  const badge = document.getElementById("connection");
  const [text, tone] = CONNECTION[state];
  badge.textContent = text;
  badge.className = `badge badge-${tone}`;
  badge.title = detail ?? "";
  document.body.dataset.connection = state;
  if (state === "key") document.getElementById("api-key").focus();
}

function showView(view) {
  renderView(view);
  setReadyModels(view.instances.filter((i) => i.status === "ready").map((i) => i.model_id));
  setImportNodes(view.nodes.map((n) => n.node_id));
  showImports(view.imports);
}

startChat();
startManaging();
const stream = followView({ onConnect: clearEvents, onView: showView, onEvent: addEvent, onState: showConnection });

const keyInput = document.getElementById("api-key");
keyInput.value = apiKey();
document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey(keyInput.value.trim());
  stream.restart();
});
