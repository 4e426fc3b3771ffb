"""`cifarkit serve`: the HTTP API, its batching pipeline and admission gate, and the web page.

Built on the inference side only."""
