"""`cifarkit predict`, `serve` and `bench-serve`: a release put to use, from the command line or over HTTP, and the
server under load."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cifarkit.cli.common import DEVICES, bounded, command, command_line
from cifarkit.core.errors import CifarkitError

BACKEND_CHOICES = ("auto", "torch-fp32", "torch-bf16", "torch-fp16", "onnxruntime")
# auto: CUDA, then MPS, then the CPU, as `cifarkit train` and `eval` pick it. A machine without a GPU sees no change;
# one with a GPU uses it, with fp32 unless the release holds accuracy figures measured on that kind of GPU.
DEVICE_HELP = "auto: CUDA, then MPS, then the CPU (default: auto)"

# `cifarkit serve` options that set a ServeSettings field; tests/test_serve.py checks the defaults their help states.
SERVE_SETTINGS = ("max_batch", "max_wait_ms", "max_queue", "timeout_s", "read_timeout_s", "max_body_mb", "threads",
                  "backend", "device")
# `cifarkit bench-serve` options that set a BenchSettings field; tests/test_bench_serve.py checks their help's defaults.
BENCH_SETTINGS = ("model", "requests", "concurrency", "warmup", "max_batch", "backend", "serve_args", "overload_queue",
                  "soak_s")
BENCH_OUT, BENCH_URL_OUT = "results/serve-bench.json", "results/serve-url-bench.json"


def cmd_predict(args) -> None:
    from cifarkit.inference.classifier import Classifier
    classifier = Classifier.load(args.model, backend=args.backend, device=args.device, verify=not args.no_verify)
    results, failed = [], 0
    for path in args.images:
        try:
            results.append({"path": path, **classifier.prediction(path, k=args.topk)})
        except (ValueError, CifarkitError) as e:  # one image's problem: report it, classify the others
            failed += 1
            print(f"cifarkit: error: {e}", file=sys.stderr)
            results.append({"path": path, "error": str(e)})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if "error" in r:
                continue
            others = ", ".join(f"{t['label']} {100 * t['confidence']:.1f}%" for t in r["topk"][1:])
            print(f"{r['path']}: {r['label']} ({100 * r['confidence']:.1f}%)" + (f"; then {others}" if others else ""))
    if failed:
        raise CifarkitError(f"{failed} of {len(args.images)} images could not be classified")


def cmd_serve(args) -> None:
    from cifarkit.serving.server import serve
    from cifarkit.serving.settings import ServeSettings
    # The options left out keep ServeSettings' defaults, the one place they are set (and explained).
    given = {name: getattr(args, name) for name in SERVE_SETTINGS if getattr(args, name) is not None}
    settings = ServeSettings(**given, verify=not args.no_verify)
    serve(args.model, host=args.host, port=args.port, settings=settings, access_log=args.access_log)


def cmd_bench_serve(args) -> None:
    from cifarkit.core.files import portable, write_json
    from cifarkit.tools import bench_serve
    given = {name: getattr(args, name) for name in BENCH_SETTINGS if getattr(args, name) is not None}
    if args.url and (servers := [name for name in bench_serve.SERVER_OPTIONS if name in given]):
        options = ", ".join("--" + name.replace("_", "-") for name in servers)
        raise CifarkitError(f"{options} set the servers that bench-serve starts, and with --url it starts none; "
                            f"drop {options} or --url")
    if "concurrency" in given:
        given["concurrency"] = tuple(given["concurrency"])
    # The options left out keep BenchSettings' defaults, the one place they are set.
    settings = bench_serve.BenchSettings(**given)
    if args.url:
        report = bench_serve.run_against(args.url, settings, command_line(args))
    else:
        report = bench_serve.run(settings, command_line(args))
    out = Path(args.out or (BENCH_URL_OUT if args.url else BENCH_OUT))
    write_json(out, report)
    print(bench_serve.table(report) + f"\n\nwrote {portable(out)}")


def register(sub) -> None:
    """Adds this group's commands to the `cifarkit` parser's subcommands."""
    p = command(sub, "predict", "classify image files with a release")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...; any size)")
    p.add_argument("--model", default="A", help="version name (./cifar10_models/version_NAME, then the shipped A, "
                                                "B), or a release folder, run folder or .safetensors path")
    p.add_argument("--topk", type=bounded(1, 10, why="CIFAR-10 has 10 classes"), default=1, metavar="K",
                   help="show the K most likely classes per image (default: 1)")
    p.add_argument("--json", action="store_true", help="one JSON list with an object per image")
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="auto: the fastest on this device of those that meet the release's accuracy rule "
                        "(docs/releases.md) (default: auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="use the release's weights (and model.onnx) even if they differ from what metrics.json records")
    p.set_defaults(func=cmd_predict)
    p = command(sub, "serve", "an HTTP API with dynamic batching, Prometheus metrics and a web page")
    p.add_argument("--model", nargs="+", default=["A", "B"], metavar="MODEL",
                   help="releases to serve: version names or paths, as `predict --model` takes them; the first is "
                        "the default of /v1/predict (default: A B)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every network)")
    p.add_argument("--port", type=bounded(0, 65535), default=8000, help="TCP port; 0 picks a free one (default: 8000)")
    p.add_argument("--max-batch", type=bounded(1, 4096),
                   help="most images per forward pass; 1 turns batching off (default: 64)")
    p.add_argument("--max-wait-ms", type=bounded(0.0, 10_000.0, float),
                   help="most a batch waits for more images after its first arrived (default: 5)")
    p.add_argument("--max-queue", type=bounded(1), help="images queued per model before requests get 503 "
                                                         "(default: 512)")
    p.add_argument("--timeout-s", type=bounded(0.001, kind=float),
                   help="a request not answered in this time gets 504 (default: 10)")
    p.add_argument("--read-timeout-s", type=bounded(0.001, kind=float),
                   help="a connection that has not sent a whole request this long after it opened or after its last "
                        "answer is closed: idle and slow clients (default: 10)")
    p.add_argument("--max-body-mb", type=bounded(0.001, kind=float),
                   help="larger request bodies get 413 before they are read (default: 10)")
    p.add_argument("--threads", type=bounded(1),
                   help="intra-op threads of the model thread, torch's or onnxruntime's (default: one per core, "
                        "but one on CPUs with AMX, where the event loop and the image decoding need a core)")
    p.add_argument("--device", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--backend", choices=BACKEND_CHOICES,
                   help="auto: per release, the fastest on this device of those that meet its accuracy rule "
                        "(docs/releases.md) (default: auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="serve weights even if they differ from what their metrics.json records")
    p.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    p.set_defaults(func=cmd_serve)
    p = command(sub, "bench-serve", "load-test `cifarkit serve` on loopback, batched against unbatched, or a server "
                                    "that runs (prints a table, writes JSON)")
    p.add_argument("--url", help="load-test the server that runs at this address, e.g. http://127.0.0.1:8000 (its "
                                 "ready line prints it), instead of starting servers here")
    p.add_argument("--model", help="the release to load-test (default: B; with --url, the server's default model)")
    p.add_argument("--requests", type=bounded(1), help="requests per load level (default: 20,000)")
    p.add_argument("--concurrency", type=bounded(1), nargs="+", metavar="CLIENTS",
                   help="load levels: clients at once, each on one keep-alive connection (default: 1 16 64 256)")
    p.add_argument("--warmup", type=bounded(0), help="unrecorded requests to each server first (default: 500)")
    p.add_argument("--max-batch", type=bounded(1, 4096), help="--max-batch of the batched servers (default: 64)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, help="--backend of the servers (default: auto)")
    p.add_argument("--serve-args", metavar="OPTIONS",
                   help="more `cifarkit serve` options for the servers, e.g. '--max-wait-ms 5' (default: none)")
    p.add_argument("--overload-queue", type=bounded(0),
                   help="--max-queue of the overload server; 0: no overload server (default: 32)")
    p.add_argument("--soak-s", type=bounded(0.0, kind=float),
                   help="seconds of load on the batched server after its levels; 0: no soak (default: 300)")
    p.add_argument("--out", help=f"the JSON to write (default: {BENCH_OUT}; with --url, {BENCH_URL_OUT})")
    p.set_defaults(func=cmd_bench_serve)
