// The cluster view (GET /view's shape) as the page's sections, brought up to date when a new view comes.

import { actionButton, badge, bar, duration, el, morphChildren, percent, size } from "./dom.js";

const TONES = {
  ready: "good",
  completed: "good",
  running: "good",
  failed: "bad",
  stopped: "muted",
  cancelled: "muted",
  queued: "muted",
};

/** A CPU node whose runners multiply with MLX's reference BLAS: float32 would be slow there (see the README). */
function slowCpu(node) {
  return node.accelerator === "cpu" && !node.fast_blas;
}

function status(text) {
  return badge(text, TONES[text] ?? "busy");
}

function empty(text) {
  return el("p", { className: "empty" }, text);
}

function field(label, ...value) {
  return el("div", { className: "field" }, el("span", { className: "label" }, label), el("span", {}, ...value));
}

function usage(usedBytes, totalBytes, detail) {
  const fraction = totalBytes ? usedBytes / totalBytes : 0;
  return [bar(fraction, fraction > 0.9 ? "bad" : "accent"), el("span", { className: "figure" }, detail)];
}

function nodeCard(node) {
  const memoryUsed = node.memory_total_bytes - node.memory_available_bytes;
  const diskUsed = node.disk_total_bytes - node.disk_free_bytes;
  return el(
    "article",
    { className: "card", dataset: { nodeId: node.node_id } },
    el(
      "header",
      {},
      el("code", { className: "id" }, node.node_id),
      badge("alive", "good"),
      node.offline ? badge("offline: no downloads", "muted") : null,
    ),
    field("host", node.hostname || "–"),
    field("accelerator", `${node.accelerator}, ${node.cpu_cores} cores${slowCpu(node) ? ", reference BLAS" : ""}`),
    field(
      "memory",
      ...usage(memoryUsed, node.memory_total_bytes, `${size(node.memory_available_bytes)} free of ${size(node.memory_total_bytes)}`),
    ),
    field("disk", ...usage(diskUsed, node.disk_total_bytes, `${size(node.disk_free_bytes)} free of ${size(node.disk_total_bytes)}`)),
    field("models on disk", String(node.models_on_disk)),
    field("model dirs", el("ul", { className: "dirs" }, node.model_dirs.map(modelDir))),
  );
}

function modelDir(dir) {
  return el(
    "li",
    { dataset: { path: dir.path } },
    el("code", { className: "id" }, dir.path),
    dir.read_only ? badge("read-only", "muted") : null,
    el("span", { className: "figure" }, `${size(dir.free_bytes)} free of ${size(dir.total_bytes)}`),
  );
}

const UNDER_WAY = new Set(["pending", "ongoing"]);

// Which of the node's model directories holds the files (and the files' own folder in it), read-only or not.
function filesAt(download) {
  if (!download.directory) return null;
  const inner = download.models_dir ? download.directory.slice(download.models_dir.length).replace(/^\/+/, "") : "";
  return el(
    "span",
    { className: "where", title: download.directory },
    "in ",
    el("code", { className: "id" }, download.models_dir || download.directory),
    inner ? el("span", { className: "muted" }, ` (${inner})`) : null,
    download.read_only ? badge("read-only", "muted") : null,
  );
}

function downloadActions(modelId, download) {
  const ids = { modelId, nodeId: download.node_id };
  const on = `${modelId} on ${download.node_id}`;
  if (UNDER_WAY.has(download.status)) return [actionButton("Cancel", `Cancel download of ${on}`, "cancel-download", ids)];
  const again = ["failed", "cancelled"].includes(download.status)
    ? actionButton("Download", `Download ${modelId} to ${download.node_id}`, "download", ids)
    : null;
  if (download.read_only) {
    return [again, el("span", { className: "note" }, "read-only directory: jetshard uses these files and never deletes them")];
  }
  return [again, actionButton("Delete files", `Delete files of ${on}`, "delete-files", ids, "danger")];
}

function downloadRow(modelId, download) {
  let detail = `${percent(download.bytes_done, download.bytes_total)} of ${size(download.bytes_total)}`;
  if (download.status === "ongoing" && download.speed_bytes_per_s) {
    detail += `, ${size(download.speed_bytes_per_s)}/s`;
    if (download.eta_s !== null) detail += `, ${duration(download.eta_s)} left`;
  }
  if (download.status === "ongoing" && download.source) {
    detail += download.source === "hub" ? " from the Hub" : ` from ${download.source}`;
  }
  const tone = download.status === "failed" ? "bad" : download.status === "completed" ? "good" : "accent";
  return el(
    "div",
    { className: "download", dataset: { nodeId: download.node_id, status: download.status } },
    el("code", { className: "id" }, download.node_id),
    el("span", { className: "muted" }, `layers [${download.start_layer}, ${download.end_layer})`),
    bar(download.bytes_total ? download.bytes_done / download.bytes_total : 0, tone),
    status(download.status),
    el("span", { className: "figure" }, detail),
    el(
      "div",
      { className: "download-more" },
      filesAt(download),
      el("span", { className: "actions" }, downloadActions(modelId, download)),
    ),
    download.reason ? el("span", { className: "reason" }, download.reason) : null,
  );
}

// A GGUF file being imported on a node: no card until it is done, so a row of its own.
export function importProgress(progress) {
  return progress.bytes_total ? `${percent(progress.bytes_done, progress.bytes_total)} of ${size(progress.bytes_total)}` : "";
}

function importRow(record) {
  const progress = record.progress;
  return el(
    "article",
    { className: "model", dataset: { modelId: record.model_id, kind: "importing" } },
    el("header", {}, el("code", { className: "id" }, record.model_id), badge("importing", "accent")),
    el(
      "div",
      { className: "download", dataset: { nodeId: record.node_id, status: "importing" } },
      el("code", { className: "id" }, record.node_id),
      el("span", { className: "muted" }, `from ${record.path}`),
      bar(progress.bytes_total ? progress.bytes_done / progress.bytes_total : 0, "accent"),
      el("span", { className: "figure" }, importProgress(progress)),
    ),
  );
}

function capabilities(model) {
  const parts = [`${model.num_layers} layers`, size(model.storage_size_bytes), `${model.context_length} context`];
  if (model.file_type) parts.push(model.file_type);
  else if (model.quantization_bits) parts.push(`${model.quantization_bits}-bit`);
  return [...parts, model.capabilities.join(" · ")].join(", ");
}

function modelRow(model, nodes) {
  const id = model.model_id;
  const elsewhere = nodes.filter((n) => !model.downloads.some((d) => d.node_id === n.node_id));
  const kind = model.builtin ? badge("built-in", "muted") : model.known ? badge("custom", "accent") : badge("no card", "bad");
  return el(
    "article",
    { className: "model", dataset: { modelId: id, kind: model.builtin ? "builtin" : model.known ? "custom" : "no-card" } },
    el(
      "header",
      {},
      el("code", { className: "id" }, id),
      kind,
      model.display_name && model.display_name !== id ? el("span", {}, model.display_name) : null,
      el(
        "span",
        { className: "actions" },
        model.known ? actionButton("Place", `Place ${id}`, "place", { modelId: id, draftModel: model.draft_model }, "") : null,
        model.builtin || !model.known
          ? null
          : actionButton("Delete card", `Delete card ${id}`, "delete-card", { modelId: id }, "danger"),
      ),
    ),
    model.known ? el("p", { className: "muted capabilities" }, capabilities(model)) : null,
    model.downloads.map((download) => downloadRow(id, download)),
    model.known && elsewhere.length
      ? el(
          "p",
          { className: "fetch" },
          el("span", { className: "muted" }, model.downloads.length ? "also download to" : "download to"),
          elsewhere.map((n) =>
            actionButton(n.node_id, `Download ${id} to ${n.node_id}`, "download", { modelId: id, nodeId: n.node_id }),
          ),
        )
      : null,
  );
}

function shardProgress(shard) {
  let shown = [];
  if (shard.status === "loading" && shard.layers_total) {
    shown = [bar(shard.layers_loaded / shard.layers_total), `${shard.layers_loaded}/${shard.layers_total} layers`];
  } else if (shard.status === "downloading" && shard.bytes_total) {
    shown = [bar(shard.bytes_done / shard.bytes_total), percent(shard.bytes_done, shard.bytes_total)];
  } else if (shard.weights_dtype) {
    shown = [shard.weights_dtype];
  }
  return el("span", { className: "progress" }, shown);
}

function shardRow(shard) {
  return el(
    "li",
    { className: "shard", dataset: { rank: shard.rank, status: shard.status } },
    el("span", { className: "muted" }, `rank ${shard.rank}`),
    el("code", { className: "id" }, shard.node_id),
    el("span", { className: "layers" }, `layers [${shard.start_layer}, ${shard.end_layer})`),
    shard.leader ? el("span", { className: "leader", title: "serves the instance's requests" }, "leader") : null,
    shard.tensor_rank === null || shard.tensor_rank === undefined
      ? null
      : el("span", { className: "tensor-rank" }, `tensor rank ${shard.tensor_rank}`),
    status(shard.status),
    shardProgress(shard),
    shard.reason ? el("span", { className: "reason" }, shard.reason) : null,
  );
}

export function throughput(instance) {
  if (instance.tokens_per_s === null || instance.tokens_per_s === undefined) return null;
  const speed = `${instance.tokens_per_s.toFixed(1)} tok/s, batch ${instance.batch_size}`;
  const acceptance = instance.draft_acceptance;
  return acceptance === null || acceptance === undefined
    ? speed
    : `${speed}, drafts kept ${Math.round(acceptance * 100)}%`;
}

function instanceCard(instance) {
  const id = instance.instance_id;
  const queued = instance.tasks_in_flight - instance.tasks_running;
  const load = [`${instance.tasks_running} running, ${queued} queued`, throughput(instance)].filter(Boolean).join("; ");
  return el(
    "article",
    { className: "card", dataset: { instanceId: instance.instance_id, status: instance.status } },
    el(
      "header",
      {},
      el("code", { className: "id" }, instance.instance_id),
      status(instance.status),
      instance.restart_attempt ? badge(`restart ${instance.restart_attempt}`, "busy") : null,
      el(
        "span",
        { className: "actions" },
        actionButton("Delete", `Delete instance ${id}`, "delete-instance", { instanceId: id }, "danger"),
      ),
    ),
    field("model", el("code", {}, instance.model_id)),
    field("engine", el("span", { className: "engine" }, instance.engine), instance.engine_chosen ? "" : " (asked for)"),
    instance.reason ? el("p", { className: "reason" }, instance.reason) : null,
    el("ol", { className: "shards" }, instance.shards.map(shardRow)),
    field("tasks", load),
    field("unloads", unloads(instance)),
  );
}

export function unloads(instance) {
  if (instance.unloads_at_ms === null || instance.unloads_at_ms === undefined) return "when removed";
  const left = Math.max(0, Math.round((instance.unloads_at_ms - Date.now()) / 1000));
  const when = left >= 60 ? `in ${Math.floor(left / 60)} min ${left % 60} s` : `in ${left} s`;
  return instance.tasks_in_flight ? `${when} after its tasks end` : when;
}

function taskTable(tasks, instances) {
  const byId = new Map(instances.map((i) => [i.instance_id, i]));
  const columns = ["task", "model", "kind", "instance", "status", "prompt tokens", "speed", ""];
  const head = el("tr", {}, columns.map((h) => el("th", {}, h)));
  const rows = tasks.map((task) =>
    el(
      "tr",
      { dataset: { taskId: task.task_id } },
      el("td", {}, el("code", { className: "clipped", title: task.task_id }, task.task_id)),
      el("td", {}, el("code", { className: "clipped", title: task.model_id }, task.model_id)),
      el("td", {}, task.kind),
      el("td", {}, el("code", { className: "clipped", title: task.instance_id }, task.instance_id)),
      el("td", {}, status(task.status)),
      el("td", { className: "number" }, task.prompt_tokens ? String(task.prompt_tokens) : "–"),
      el("td", {}, throughput(byId.get(task.instance_id) ?? {}) ?? "–"),
      el("td", {}, actionButton("Cancel", `Cancel task ${task.task_id}`, "cancel-task", { taskId: task.task_id }, "danger")),
    ),
  );
  return el("div", { className: "table-scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

// The models on some node's disk, placed or added first, then the rest of the built-in catalogue.
function inUseFirst(models) {
  return [...models.filter((m) => m.in_use), ...models.filter((m) => !m.in_use)];
}

// Each section is built anew and only what differs is changed on the page (see morphChildren).
function fill(id, count, children, none) {
  document.getElementById(`${id}-count`).textContent = count ? String(count) : "";
  morphChildren(document.getElementById(id), count ? children : [empty(none)]);
}

export function renderView(view) {
  fill("nodes", view.nodes.length, view.nodes.map(nodeCard), "no nodes: start `jetshard worker` (or `jetshard up`)");
  const models = inUseFirst(view.models).map((m) => modelRow(m, view.nodes));
  fill("models", view.models.length, [...view.imports.map(importRow), ...models], "no models");
  fill("instances", view.instances.length, view.instances.map(instanceCard), "no instances");
  fill("tasks", view.tasks.length, [taskTable(view.tasks, view.instances)], "none");
  document.getElementById("last-seq").textContent = `at event ${view.last_seq}`;
}
