"""Status pages over the job service: what a user sees of a Beam job on Spark.

Reads the job service's data (the same as the Job API); knows nothing of
Spark. Nothing in the package imports it.
"""
