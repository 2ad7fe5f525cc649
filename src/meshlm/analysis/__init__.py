"""Analysis: hidden-state probes, figures, HTML reports and multi-run studies."""
