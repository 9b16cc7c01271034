"""Fixtures of the audit tests: one real federation run per session
(:func:`tests.support.audit.audit_workspace`) and each test's own copy of it."""

from tests.support.audit import audit_workspace, workspace_copy

__all__ = ["audit_workspace", "workspace_copy"]
