"""Trust: the job's secret (``secret``) and what it signs (``signed``: stores and pickles). Only the job's own
processes speak in its stores and its object collectives."""
