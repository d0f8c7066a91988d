"""Engine memory in the daemon: the kinds of mapping (sealed memfds, /dev/shm names, CUDA IPC), which a session may
use, the strided regions over them, every address a transfer touches, and which session owns which memory.

Imports: errors, values; torch (CUDA IPC, imported only when a CUDA region is registered).
"""
