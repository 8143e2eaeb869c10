"""Deprecated: refit_client.integrations (refit_operator/tools/__init__.py says why)."""
