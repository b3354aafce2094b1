// The cluster view (GET /view's shape) as the page's sections; each is rebuilt whole when a new view comes.

import { badge, bar, duration, el, percent, size } from "./dom.js";

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
  );
}

function downloadRow(download) {
  let detail = `${percent(download.bytes_done, download.bytes_total)} of ${size(download.bytes_total)}`;
  if (download.status === "ongoing" && download.speed_bytes_per_s) {
    detail += `, ${size(download.speed_bytes_per_s)}/s`;
    if (download.eta_s !== null) detail += `, ${duration(download.eta_s)} left`;
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
    download.reason ? el("span", { className: "reason" }, download.reason) : null,
  );
}

function modelRow(model) {
  return el(
    "article",
    { className: "model", dataset: { modelId: model.model_id } },
    el(
      "header",
      {},
      el("code", { className: "id" }, model.model_id),
      model.display_name && model.display_name !== model.model_id ? el("span", {}, model.display_name) : null,
      el("span", { className: "muted" }, `${model.num_layers} layers, ${size(model.storage_size_bytes)}`),
    ),
    model.downloads.length ? model.downloads.map(downloadRow) : el("p", { className: "empty" }, "on no node's disk yet"),
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
  return `${instance.tokens_per_s.toFixed(1)} tok/s, batch ${instance.batch_size}`;
}

function instanceCard(instance) {
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
    ),
    field("model", el("code", {}, instance.model_id)),
    instance.reason ? el("p", { className: "reason" }, instance.reason) : null,
    el("ol", { className: "shards" }, instance.shards.map(shardRow)),
    field("tasks", load),
  );
}

function taskTable(tasks, instances) {
  const byId = new Map(instances.map((i) => [i.instance_id, i]));
  const head = el("tr", {}, ["task", "model", "kind", "instance", "status", "prompt tokens", "speed"].map((h) => el("th", {}, h)));
  const rows = tasks.map((task) =>
    el(
      "tr",
      { dataset: { taskId: task.task_id } },
      el("td", {}, el("code", { className: "clipped", title: task.task_id }, task.task_id)),
      el("td", {}, el("code", { className: "clipped", title: task.model_id }, task.model_id)),
      el("td", {}, task.kind),
      el("td", {}, el("code", { className: "clipped", title: task.instance_id }, task.instance_id)),
      el("td", {}, status(task.status)),
      el("td", { className: "number" }, String(task.prompt_tokens)),
      el("td", {}, throughput(byId.get(task.instance_id) ?? {}) ?? "–"),
    ),
  );
  return el("div", { className: "table-scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function fill(id, count, children, none) {
  document.getElementById(`${id}-count`).textContent = count ? String(count) : "";
  document.getElementById(id).replaceChildren(...(count ? children : [empty(none)]));
}

export function renderView(view) {
  fill("nodes", view.nodes.length, view.nodes.map(nodeCard), "no nodes: start `jetshard worker` (or `jetshard up`)");
  fill("models", view.models.length, view.models.map(modelRow), "no models downloaded or placed");
  fill("instances", view.instances.length, view.instances.map(instanceCard), "no instances");
  fill("tasks", view.tasks.length, [taskTable(view.tasks, view.instances)], "none");
  document.getElementById("last-seq").textContent = `at event ${view.last_seq}`;
}
