"""Sharing a cluster (issue 22), measured on a real stack."""
