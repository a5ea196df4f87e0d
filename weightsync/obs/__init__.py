"""Observability: HTTP health and metrics endpoints, metric definitions, structured logs."""
