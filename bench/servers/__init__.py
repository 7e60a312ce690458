"""The HTTP benchmark servers: Starlette and aiohttp, each raw, with tether, or polling."""
