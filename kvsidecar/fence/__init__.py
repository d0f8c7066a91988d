"""The listener fence: no TCP listener of the daemon process accepts a connection from outside its allow-list.

Imports: errors.
"""
