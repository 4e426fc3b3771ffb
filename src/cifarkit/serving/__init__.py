"""`cifarkit serve`: releases behind an HTTP API (FastAPI on uvicorn), with dynamic batching, Prometheus metrics and a
page to try them on.

    cifarkit serve --model B          # the page at http://127.0.0.1:8000, the API's OpenAPI at /docs
    curl -F file=@cat.png 'http://127.0.0.1:8000/v1/predict?model=B&topk=3'
    curl --data-binary @cat.png -H 'Content-Type: image/png' http://127.0.0.1:8000/v1/predict

One image's path: the event loop reads the body (refused past `max_body_mb`, from its Content-Length when it has
one, before a byte of it is read) and queues it; a decode thread turns it into 32 x 32 pixels, and a model thread
runs it in a batch (`Pipeline`). A full queue is refused at once (503, Retry-After), and an image not answered
within `timeout_s` gets 504. Every error is a JSON body, {"detail": "..."}, that names the problem.

The modules, in the order a request meets them: `settings` (every default), `server` (the socket, uvicorn, a
graceful stop), `gate` (key, body limit, metrics), `app` (the routes), `pipeline` (decode and model threads).

This package is the inference side alone: it imports no training code (engine, optim, the data set and its loaders,
TensorBoard, matplotlib). tests/test_serve.py checks that in a running server.
"""
