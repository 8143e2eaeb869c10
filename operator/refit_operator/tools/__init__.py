"""Deprecated: the trainer-side SDK is a package of its own, refit_client (sdk/refit_client).

The modules here are its old import paths, kept for one release: each one imports the module
that replaced it, warns its importer (DeprecationWarning) with the new path, and is that
module, so every object is the same one. Nothing of the operator imports them.
"""
