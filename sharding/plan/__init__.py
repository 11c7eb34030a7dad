"""Plan files and what is said about a plan: the versioned JSON format (``io``, ``errors``), the one
check of a plan's contents (``validation``), reports in text and HTML (``report``, ``html``) and
the does-not-fit explanation (``fit_report``).

Submodules are imported by their full names; importing this package imports nothing else.
"""
