"""Pure planning: a Runner API pipeline in, fused stages out.

Nothing here imports Spark or gRPC; the Spark translation and the job
service both consume :class:`ExecutionPlan`.
"""

from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.plan import GroupSpec
from beam_pyspark.planning.plan import SideInputSpec
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.planning.plan import TimerSpec
from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.planning.validate import check_supported

__all__ = [
    'ExecutionPlan',
    'GroupSpec',
    'SideInputSpec',
    'StagePlan',
    'TimerSpec',
    'check_supported',
    'plan_pipeline',
]
