"""Evaluation: lm-eval suites over lists of models, KV-cache facts, and the accuracy-vs-compression report."""
