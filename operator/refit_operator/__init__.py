"""The Refit operator: reconciles WeightRefit resources over a vLLM fleet."""
