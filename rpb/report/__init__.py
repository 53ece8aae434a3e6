"""The report wing: reads the files that the pipeline wrote (evaluation outputs, run records) and
builds the statistics, tables, claims, figures and HTML pages from them. It imports the library's
names (`rpb.specs`, the router-swap design, co-activation metrics) and never the pipeline; it
runs no model. Needs the `pipeline` extra."""
