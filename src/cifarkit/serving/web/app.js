// The page of `cifarkit serve`: one image in, the model's top classes out. No build step, no outside resources.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "cifarkit-api-key";
const TOPK = 5;

let models = [];      // from /v1/models
let current = null;   // the last file sent: a new model or a new key classifies it again
let sent = 0;         // numbers the requests, so a slow answer never overwrites a newer one
let previewUrl = null;

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The server's errors are {"detail": "..."}; anything else (a proxy's page, a dropped connection) is told as is.
async function failure(response) {
  let detail = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.detail) detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (_) { /* not JSON: keep the status text */ }
  if (response.status === 401) askForKey();
  const retry = response.headers.get("Retry-After");
  return `${response.status}: ${detail}${retry ? ` (retry after ${retry} s)` : ""}`;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
  if (text) reveal($("error"));
}

// On a phone the answer is below the inputs: bring it into view, but never move a page that already shows it.
function reveal(element) {
  const box = element.getBoundingClientRect();
  if (box.top < 0 || box.bottom > window.innerHeight) element.scrollIntoView({ block: "start", behavior: "smooth" });
}

function askForKey() {
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    showError(`cannot reach the server: ${e.message}`);
    return;
  }
  if (!response.ok) {
    showError(await failure(response));
    return;
  }
  const body = await response.json();
  models = body.models;
  const select = $("model");
  select.replaceChildren(...models.map((m) => new Option(`${m.name} (${m.model})`, m.name, false,
                                                         m.name === body.default)));
  select.disabled = false;
  showCard();
  showError("");
}

const percent = (x, digits = 1) => `${(100 * x).toFixed(digits)}%`;
const count = (x) => new Intl.NumberFormat("en", { notation: "compact", maximumFractionDigits: 2 }).format(x);

function showCard() {
  const m = models.find((x) => x.name === $("model").value);
  if (!m) return;
  // A CPU's figures are kept by its kind (amx, avx2, ...), a GPU's by its device type (cuda, mps).
  const where = m.device === "cpu" ? `a ${m.cpu_kind} CPU` : m.cpu_kind;
  const facts = [
    ["Architecture", m.model],
    ["Recipe", m.recipe],
    ["Parameters", m.params != null ? `${count(m.params)} (${m.params.toLocaleString("en")})` : null],
    ["MACs / image", m.macs != null ? count(m.macs) : null],
    ["Test accuracy", m.test_accuracy != null
      ? `${percent(m.test_accuracy, 2)} on ${(m.test_images || 0).toLocaleString("en")} images` : null],
    // The spread over seeds says how much of the accuracy above is luck of the run.
    ["Over runs", m.runs && m.runs.n
      ? `${percent(m.runs.mean, 2)} ± ${percent(m.runs.std, 2)} (n = ${m.runs.n}`
        + `${m.runs.evaluation ? `, ${m.runs.evaluation}` : ""})` : null],
    ["Backend", m.onnx_provider ? `${m.backend} (${m.onnx_provider})` : m.backend],
    ["Device", m.device],
    // Speeds measured on a device of this server's kind only: another machine's img/s is not this one's.
    ["Images/s", m.images_per_s
      ? Object.entries(m.images_per_s).map(([k, v]) => `${Math.round(v).toLocaleString("en")} at ${k.replace("_", " ")}`)
          .join(", ") + ` (measured on ${where})` : `not measured on ${where}`],
    ["Weights sha256", m.weights_sha256 ? `${m.weights_sha256.slice(0, 12)}…` : null],
    ["Created", m.created ? m.created.slice(0, 10) : null],
  ];
  $("card").replaceChildren(...facts.filter(([, v]) => v != null).flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = k;
    dd.textContent = v;
    if (k === "Weights sha256") dd.title = m.weights_sha256;
    if (k === "Backend" && m.backend_reason) dd.title = m.backend_reason;
    if (k === "Test accuracy" && m.test_accuracy_evaluation) dd.title = m.test_accuracy_evaluation;
    return [dt, dd];
  }));
}

function showPreview(file) {
  if (previewUrl) URL.revokeObjectURL(previewUrl);
  previewUrl = URL.createObjectURL(file);
  const img = $("preview");
  img.alt = `preview of ${file.name || "the pasted image"}`;
  img.src = previewUrl;
  img.hidden = false;
}

function clearAnswer() {
  $("result-label").textContent = "";
  $("result-confidence").textContent = "";
  $("latency").textContent = "";
  $("bars").replaceChildren();
}

function showAnswer(prediction) {
  $("result-label").textContent = prediction.label;
  $("result-confidence").textContent = percent(prediction.confidence);
  $("bars").replaceChildren(...prediction.topk.map(({ label, confidence }) => {
    const li = document.createElement("li");
    const name = document.createElement("span");
    const track = document.createElement("span");
    const fill = document.createElement("span");
    const value = document.createElement("span");
    name.className = "name";
    name.textContent = label;
    track.className = "track";
    track.setAttribute("aria-hidden", "true");
    fill.className = "fill";
    // A CSSOM property, not a style attribute: the page's CSP allows it.
    fill.style.width = percent(confidence);
    value.className = "value";
    value.textContent = percent(confidence);
    track.append(fill);
    li.append(name, track, value);
    return li;
  }));
}

async function classify(file) {
  current = file;
  const mine = ++sent;
  const model = $("model").value;
  showError("");
  clearAnswer();
  if (file.type.startsWith("image/")) showPreview(file); else $("preview").hidden = true;
  $("status").textContent = `Classifying ${file.name || "the image"}…`;
  const url = `/v1/predict?topk=${TOPK}${model && !$("model").disabled ? `&model=${encodeURIComponent(model)}` : ""}`;
  // Timed in the browser: upload, queue, model and download together, as a user waits for them.
  const started = performance.now();
  let response, body, error;
  try {
    response = await fetch(url, {
      method: "POST", body: file, headers: headers({ "Content-Type": file.type || "application/octet-stream" }),
    });
    if (response.ok) body = await response.json(); else error = await failure(response);
  } catch (e) {
    error = `cannot reach the server: ${e.message}`;
  }
  const ms = performance.now() - started;
  if (mine !== sent) return;
  if (error) {
    $("status").textContent = `${file.name || "The image"} was not classified.`;
    showError(error);
    return;
  }
  $("status").textContent = `${file.name || "The image"}, by model ${body.model}:`;
  showAnswer(body.predictions[0]);
  $("latency").textContent = `${ms.toFixed(0)} ms in the browser, upload to answer`;
  reveal($("answer"));
}

async function classifyExample(button) {
  const src = button.dataset.src;
  try {
    const response = await fetch(src);
    if (!response.ok) throw new Error(`${response.status} for ${src}`);
    const blob = await response.blob();
    await classify(new File([blob], src.split("/").pop(), { type: blob.type || "image/png" }));
  } catch (e) {
    showError(`cannot load the example: ${e.message}`);
  }
}

function setUp() {
  const drop = $("drop");
  const input = $("file");
  drop.addEventListener("click", () => input.click());
  drop.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();  // Space would scroll the page
      input.click();
    }
  });
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    const file = e.dataTransfer.files[0];
    if (file) classify(file);
  });
  // A file dropped beside the zone would make the browser leave the page to open it.
  window.addEventListener("dragover", (e) => e.preventDefault());
  window.addEventListener("drop", (e) => e.preventDefault());

  input.addEventListener("change", () => {
    if (input.files[0]) classify(input.files[0]);
    input.value = "";  // choosing the same file again fires change again
  });
  document.addEventListener("paste", (e) => {
    const file = [...e.clipboardData.files][0];
    if (file) {
      e.preventDefault();
      classify(file);
    }
  });
  $("examples").addEventListener("click", (e) => {
    const button = e.target.closest("button[data-src]");
    if (button) classifyExample(button);
  });
  $("model").addEventListener("change", () => {
    showCard();
    if (current) classify(current);
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("key-form").hidden = true;
    if (!models.length) await loadModels();
    if (current) classify(current);
  });
  if (sessionStorage.getItem(KEY)) $("api-key").value = sessionStorage.getItem(KEY);
  loadModels();
}

setUp();
