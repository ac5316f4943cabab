"""Outputs: audit.json, policy.json, report.html and the terminal summary."""
