"""Engine sessions: one rank's or scheduler's identity, layout, rights, memory and lease; the registry that opens,
renews, expires and closes them; the value shapes their registrations claim.

Imports: errors, values, metrics, memory, movers, tenancy.
"""
