"""Who a caller is and what it may do: the tenants table (pure), the live tenancy that grants sessions and counts
refusals, write budgets, retention budgets, and the side socket's peer credentials and tickets. Every right is off
unless granted.

Imports: errors, parsing, metrics, store, values.
"""
