"""Reading runs: summaries and reports, plots, the runs index, exports."""
