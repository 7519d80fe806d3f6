"""One module per report section, each exposing ``SECTION`` (see actmap.report.sections)."""
