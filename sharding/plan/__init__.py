"""Plan files and what is said about a plan: the versioned JSON format (``file_format``), reading
and writing plan files (``io``, ``errors``), the one check of a plan's contents (``validation``),
reports in text and HTML (``report``, ``html`` with its figures in ``svg_charts``) and the
does-not-fit explanation (``fit_report``).

Submodules are imported by their full names; importing this package imports nothing else.
"""
