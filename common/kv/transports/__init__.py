"""The built-in KV transports (common.kv.transport), one module each, loaded by name when first used."""
