"""Batch pipelines over many records: ``lookupdec rewrite`` (resumable, crash-safe output).

``inputs`` reads records from ``.jsonl`` files, text files and folders; ``results`` is the
output file (whole lines, one per id, repaired after a kill); ``rewrite`` runs one engine over
the records still to do; ``cluster`` shares them among Ray workers (``--ray``, imported only then).
"""
from lookupdec.pipelines.inputs import InputError, ReadOptions, Record, read_records
from lookupdec.pipelines.results import ResultsFile, ResultsFileError, read_results
from lookupdec.pipelines.rewrite import PromptFormat, RewriteOptions, RewriteSummary, plan, rewrite

__all__ = ["InputError", "PromptFormat", "ReadOptions", "Record", "ResultsFile", "ResultsFileError",
           "RewriteOptions", "RewriteSummary", "plan", "read_records", "read_results", "rewrite"]
