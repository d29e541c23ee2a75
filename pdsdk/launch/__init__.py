"""`pdsdk launch`: start prefill/decode workers of an engine and the router, supervise, stop cleanly."""
