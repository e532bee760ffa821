"""tether studio: a local web app over run directories and the library's own functions.

`tether studio` (tether/studio/command.py) serves app.py's FastAPI app; each page is one module
here exposing `router` (prefix /api/<page>) plus tether/studio/static/<page>.{html,js}. The
conventions for adding a page are at the top of docs/studio.md. Needs `pip install 'tether[studio]'`.
"""
