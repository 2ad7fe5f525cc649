"""`meshlm serve`: an OpenAI-compatible HTTP server over continuous batching (docs/serve.md).

    meshlm.serve.batcher   Request, Batcher: requests join and leave running batches at token
                           boundaries (no HTTP)
    meshlm.serve.cohorts   the running batches: join (newcomers prefilled together, stacked
                           right-aligned), step, leave
    meshlm.serve.text      detokenised streaming and stop strings; chat templates
    meshlm.serve.app       the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models,
                           /health, /metrics
"""
