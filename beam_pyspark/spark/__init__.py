"""Translation of an ExecutionPlan into Spark RDD jobs."""
