"""Run the real services as local processes: used by the demo and the e2e tests."""
