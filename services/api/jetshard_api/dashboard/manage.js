// Running the cluster from the page: adding and deleting model cards, placing (after a preview) and deleting
// instances, starting, cancelling and deleting downloads, cancelling tasks. Every change goes through the API;
// the page shows its effect when the view stream brings it, and an error in the API's own words.

import { apiFetch, errorMessage } from "./api.js";
import { el, labelled, size } from "./dom.js";
import { importProgress } from "./view.js";

const $ = (id) => document.getElementById(id);

// "org/name" as two path segments, each escaped.
const modelPath = (modelId) => modelId.split("/").map(encodeURIComponent).join("/");

function say(text, tone = "") {
  const notice = $("notice");
  notice.textContent = text;
  notice.className = `notice ${tone}`;
}

// Sends one request; the API's error message when it refuses, else null.
async function send(method, path, body) {
  return (await sent(method, path, body)).error;
}

// `send`, with the response itself when there is no error, for a caller that reads its answer.
async function sent(method, path, body) {
  const init = { method };
  if (body !== undefined) {
    init.headers = { "Content-Type": "application/json" };
    init.body = JSON.stringify(body);
  }
  try {
    const response = await apiFetch(path, init);
    return response.ok ? { error: null, response } : { error: await errorMessage(response) };
  } catch (error) {
    return { error: String(error?.message ?? error) };
  }
}

// --- a confirmation, in a dialog of the page's own -----------------------------------------------------------

// Resolves true once the user presses the dialog's `action` button, false on Cancel or Escape.
function confirmAction({ title, text, action }) {
  const dialog = $("confirm-dialog");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-yes").textContent = action;
  return new Promise((resolve) => {
    const answer = (yes) => () => {
      $("confirm-yes").onclick = $("confirm-no").onclick = dialog.onclose = null;
      dialog.close();
      resolve(yes);
    };
    $("confirm-yes").onclick = answer(true);
    $("confirm-no").onclick = dialog.onclose = answer(false);
    dialog.showModal();
  });
}

// --- placing, after a preview --------------------------------------------------------------------------------

let placing = null; // the model the place dialog is for
let previewed = 0; // the latest preview asked for: an older answer arriving late is dropped

function previewTable(preview) {
  const head = el("tr", {}, ["rank", "node", "layers", "device", "memory"].map((h) => el("th", {}, h)));
  const rows = preview.shards.map((shard) =>
    el(
      "tr",
      { dataset: { nodeId: shard.node_id, rank: shard.rank } },
      el("td", { className: "number" }, String(shard.rank)),
      el("td", {}, el("code", {}, shard.node_id)),
      el("td", { className: "layers" }, `[${shard.start_layer}, ${shard.end_layer})`),
      el("td", {}, shard.device),
      el("td", { className: "number" }, size(shard.memory_bytes)),
    ),
  );
  const serving = preview.serving;
  const engine = $("place-engine").value ? preview.engine : `${preview.engine} (placement's choice)`;
  return [
    el("table", { className: "preview" }, el("thead", {}, head), el("tbody", {}, rows)),
    el(
      "p",
      { className: "muted preview-summary" },
      `on ${engine}; ${size(preview.required_bytes)} in all; weights ${serving.weights}; ` +
        `KV cache ${serving.kv_cache_type}; ${serving.draft ? `drafting ${serving.draft}; ` : ""}` +
        `up to ${serving.max_batch} requests at once`,
    ),
  ];
}

async function preview() {
  const asked = ++previewed;
  const model = placing;
  const minNodes = $("place-min-nodes").value || "1";
  $("place-confirm").disabled = true;
  $("place-message").textContent = "";
  $("place-preview").replaceChildren(el("p", { className: "muted" }, "working out where it would go…"));
  let shown;
  let ready = false;
  try {
    const query = new URLSearchParams({ model_id: model, min_nodes: minNodes });
    if ($("place-engine").value) query.set("engine", $("place-engine").value);
    if ($("place-kv-cache").value) query.set("kv_cache_type", $("place-kv-cache").value);
    if ($("place-draft").value) query.set("draft", $("place-draft").value);
    const response = await apiFetch(`/instances/preview?${query}`);
    if (response.ok) {
      shown = previewTable(await response.json());
      ready = true;
    } else {
      shown = [el("p", { className: "reason impossible" }, `It cannot be placed now: ${await errorMessage(response)}`)];
    }
  } catch (error) {
    shown = [el("p", { className: "reason impossible" }, String(error?.message ?? error))];
  }
  if (asked !== previewed || placing !== model) return;
  $("place-preview").replaceChildren(...shown);
  $("place-confirm").disabled = !ready;
}

// The drafting choices for a model: the API's setting, prompt lookup, and the model its card pairs it with.
function draftOptions(draftModel) {
  return [
    el("option", { value: "" }, "the API's setting"),
    el("option", { value: "ngram" }, "ngram (prompt lookup)"),
    draftModel ? el("option", { value: draftModel }, `${draftModel} (its card's draft model)`) : null,
  ].filter(Boolean);
}

function openPlace(modelId, draftModel) {
  placing = modelId;
  $("place-title").textContent = `Place ${modelId}`;
  $("place-min-nodes").value = "1";
  $("place-engine").value = "";
  $("place-kv-cache").value = "";
  $("place-draft").replaceChildren(...draftOptions(draftModel));
  $("place-draft").value = "";
  $("place-dialog").showModal();
  preview();
}

async function place() {
  const model = placing;
  const confirm = $("place-confirm");
  confirm.disabled = true;
  const body = { model_id: model, min_nodes: Number($("place-min-nodes").value || "1") };
  if ($("place-engine").value) body.engine = $("place-engine").value;
  const serving = {};
  if ($("place-kv-cache").value) serving.kv_cache_type = $("place-kv-cache").value;
  if ($("place-draft").value) serving.draft = $("place-draft").value;
  if (Object.keys(serving).length) body.serving = serving;
  let failure;
  let placed = null;
  try {
    const response = await apiFetch("/instances", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (response.ok) placed = (await response.json()).instance_id;
    else failure = await errorMessage(response);
  } catch (error) {
    failure = String(error?.message ?? error);
  }
  if (placed === null) {
    $("place-message").textContent = failure;
    confirm.disabled = false;
    return;
  }
  $("place-dialog").close();
  say(`Placed ${model} as instance ${placed}`, "good");
}

// --- the actions the view's buttons name ---------------------------------------------------------------------

const ACTIONS = {
  place: ({ modelId, draftModel }) => openPlace(modelId, draftModel),
  async "delete-card"({ modelId }) {
    const yes = await confirmAction({
      title: `Delete the card of ${modelId}?`,
      text: "Every node forgets the model; files already downloaded stay where they are.",
      action: "Delete",
    });
    if (!yes) return null;
    return [await send("DELETE", `/models/${modelPath(modelId)}`), `Deleted the card of ${modelId}`];
  },
  async download({ modelId, nodeId }) {
    const error = await send("POST", "/downloads", { model_id: modelId, node_id: nodeId });
    return [error, `Downloading ${modelId} to ${nodeId}`];
  },
  async "cancel-download"({ modelId, nodeId }) {
    const error = await send("POST", "/downloads/cancel", { model_id: modelId, node_id: nodeId });
    return [error, `Cancelled the download of ${modelId} on ${nodeId}`];
  },
  async "delete-files"({ modelId, nodeId }) {
    const yes = await confirmAction({
      title: `Delete the files of ${modelId} on ${nodeId}?`,
      text: "They are removed from the node's disk; downloading the model again fetches them anew.",
      action: "Delete",
    });
    if (!yes) return null;
    const error = await send("DELETE", `/downloads/${encodeURIComponent(nodeId)}/${modelPath(modelId)}`);
    return [error, `Deleted the files of ${modelId} on ${nodeId}`];
  },
  async "delete-instance"({ instanceId }) {
    const yes = await confirmAction({
      title: `Delete instance ${instanceId}?`,
      text: "Its runners stop, and the requests it is serving end with an error.",
      action: "Delete",
    });
    if (!yes) return null;
    return [await send("DELETE", `/instances/${encodeURIComponent(instanceId)}`), `Deleted instance ${instanceId}`];
  },
  async "cancel-task"({ taskId }) {
    return [await send("DELETE", `/tasks/${encodeURIComponent(taskId)}`), `Cancelled task ${taskId}`];
  },
};

async function act(button) {
  const label = button.getAttribute("aria-label");
  button.disabled = true;
  const outcome = await ACTIONS[button.dataset.action](JSON.parse(button.dataset.ids));
  button.disabled = false;
  if (outcome) {
    const [error, done] = outcome;
    say(error ?? done, error ? "error" : "good");
  }
  // Back where the user was, should the view have been rebuilt meanwhile (or a dialog have taken the focus).
  if (!document.querySelector("dialog[open]")) labelled(document.querySelector(".cluster"), label)?.focus();
}

// --- adding a model by its Hugging Face id, or one GGUF file of a repo (`org/name:file.gguf`) -------------------

// `org/name` asks for a transformers-style repo's card; `org/name:path/in/repo.gguf` for the card of that GGUF file,
// with the repo as its id (a repo id never has a colon).
function addModelBody(value) {
  const colon = value.indexOf(":");
  if (colon < 0) return { model_id: value };
  return { model_id: value.slice(0, colon), gguf_file: value.slice(colon + 1) };
}

async function addModel(event) {
  event.preventDefault();
  const input = $("add-model-id");
  const message = $("add-model-message");
  const value = input.value.trim();
  if (!value) return;
  const body = addModelBody(value);
  $("add-model").disabled = true;
  message.textContent = `Fetching the card of ${value} from the Hub…`;
  message.className = "form-message";
  const error = await send("POST", "/models", body);
  $("add-model").disabled = false;
  message.textContent = error ?? `Added ${body.model_id}: its card is on every node`;
  message.className = `form-message ${error ? "error" : "good"}`;
  if (!error) input.value = "";
}

// --- importing a GGUF file a node has ----------------------------------------------------------------------

let importing = null; // the import this page asked for, until its answer comes

// How far the import this page asked for is, in its message while it waits for the answer.
export function showImports(imports) {
  const record = importing && imports.find((i) => i.node_id === importing.node_id && i.path === importing.path);
  if (record) $("import-message").textContent = `Importing ${record.path} on ${record.node_id}… ${importProgress(record.progress)}`;
}

// The nodes a file can be imported on, offered in the picker (the current choice kept while it stays).
export function setImportNodes(nodeIds) {
  const select = $("import-node");
  const shown = [...select.options].map((o) => o.value);
  if (nodeIds.join("\n") !== shown.join("\n")) {
    const chosen = select.value;
    select.replaceChildren(...nodeIds.map((id) => el("option", { value: id }, id)));
    if (nodeIds.includes(chosen)) select.value = chosen;
  }
}

async function importFile(event) {
  event.preventDefault();
  const message = $("import-message");
  const body = { node_id: $("import-node").value, path: $("import-path").value.trim() };
  const modelId = $("import-id").value.trim();
  if (modelId) body.model_id = modelId;
  $("import").disabled = true;
  message.textContent = `Importing ${body.path} on ${body.node_id}…`;
  message.className = "form-message";
  importing = body;
  const { error, response } = await sent("POST", "/models/import", body);
  const card = error ? null : await response.json();
  importing = null;
  $("import").disabled = false;
  message.textContent = error ?? `Imported ${card.model_id} (${card.file_type || "GGUF"}) on ${body.node_id}`;
  message.className = `form-message ${error ? "error" : "good"}`;
  if (!error) {
    $("import-path").value = "";
    $("import-id").value = "";
  }
}

// --- the cluster's keep-alive for models placed by requests ---------------------------------------------------

async function showKeepAlive() {
  const response = await apiFetch("/settings").catch(() => null);
  if (!response?.ok) return;
  const settings = await response.json();
  $("keep-alive-s").value = settings.model_keep_alive_s;
}

async function saveKeepAlive(event) {
  event.preventDefault();
  const seconds = Number($("keep-alive-s").value);
  const message = $("keep-alive-message");
  $("keep-alive-save").disabled = true;
  const error = await send("PUT", "/settings", { model_keep_alive_s: seconds });
  $("keep-alive-save").disabled = false;
  const kept = seconds < 0 ? "stay loaded until removed" : `unload after ${seconds} s idle`;
  message.textContent = error ?? `Models placed for requests from now on ${kept}, on every API`;
  message.className = `form-message ${error ? "error" : "good"}`;
}

export function startManaging() {
  $("add-model-form").addEventListener("submit", addModel);
  $("import-form").addEventListener("submit", importFile);
  $("keep-alive-form").addEventListener("submit", saveKeepAlive);
  showKeepAlive();
  document.querySelector(".cluster").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button && !button.disabled) act(button);
  });
  $("place-min-nodes").addEventListener("input", preview);
  $("place-engine").addEventListener("change", preview);
  $("place-kv-cache").addEventListener("change", preview);
  $("place-draft").addEventListener("change", preview);
  $("place-confirm").addEventListener("click", place);
  $("place-cancel").addEventListener("click", () => $("place-dialog").close());
  $("place-dialog").addEventListener("close", () => {
    const opener = placing && labelled(document.querySelector(".cluster"), `Place ${placing}`);
    placing = null;
    opener?.focus();
  });
}
