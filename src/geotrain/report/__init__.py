"""Reports of a simulated or measured run: timeline pictures, an HTML page, comparisons."""
