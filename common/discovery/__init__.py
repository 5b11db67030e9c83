"""Worker discovery: `Discovery` (base.py) and its backends (static.py; Consul later)."""
from common.discovery.base import Discovery, Role
from common.discovery.static import StaticDiscovery, parse_endpoints

__all__ = ["Discovery", "Role", "StaticDiscovery", "parse_endpoints"]
