"""Refit's vLLM plugin. Importing this package imports nothing heavy: vLLM and torch are
imported only by the modules that need them."""
