"""Save, lookup, load and reset: placement plans carried out against the store and engine memory, with the
accounting of every outcome, the backoff from a full store and a load's retries of transient failures.

Imports: errors, reasons, values, metrics, store, memory, movers, tenancy, sessions, events.
"""
