"""Integrations of Refit with training frameworks (optional extras: ``refit[trl]``).

Each module imports its framework, and torch, only when it is used.
"""
