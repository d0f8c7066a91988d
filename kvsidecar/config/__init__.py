"""The daemon's configuration, at the top of the house: one object built from CLI flags and one optional TOML file,
then cut into what each part is told.

Each setting is declared once, as a field (fields.py) with its help text, parser and flag group beside it
(`setting`, groups.py); the flags, `serve --help`'s sections, the config file's keys and the defaults all come from
those fields (flags.py reads the command line and the file); `Config` is those fields checked across settings
whenever one is made (checks.py); and cut.py turns a Config into each part's settings (their types are the parts',
daemon/settings.py gathers them). Defaults and parsers live with the part they configure (parsing.py for text such
as sizes): this room imports them, and only the command line imports this room.

Imports: errors, parsing, metrics, fence, events, tenancy, movers, sessions, tiers, rpc, daemon.
"""

from kvsidecar.config.checks import Config
from kvsidecar.config.cut import settings_of
from kvsidecar.config.flags import add_flags, build, from_args, load_file

__all__ = ["Config", "add_flags", "build", "from_args", "load_file", "settings_of"]
