"""The audit inside the training frameworks people already use (README.md, "In a Trainer").

- :mod:`precision_audit.integrations.transformers`: ``PrecisionAuditCallback`` for Hugging Face's ``Trainer``;
- :mod:`precision_audit.integrations.lightning`: ``PrecisionAuditCallback`` for Lightning's ``Trainer``.

Each audits the model on the first training batch, before the first optimizer step, writes the outputs into the
trainer's folder under ``precision-audit/``, logs the summary and, with ``apply_policy=True``, trains on under
the policy. Importing this package imports neither framework.
"""
