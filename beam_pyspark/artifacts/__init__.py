"""Artifact staging (Beam's reverse retrieval protocol) and retrieval.

``ArtifactStagingService`` receives a job's artifacts from the client into a
content-addressed directory; ``ArtifactRetrievalService`` serves them from
there to SDK workers. Imports Beam, gRPC and ``beam_pyspark.errors`` only.
"""

from beam_pyspark.artifacts.retrieval import ArtifactRetrievalService
from beam_pyspark.artifacts.retrieval import ArtifactServiceError
from beam_pyspark.artifacts.staging import ArtifactStagingError
from beam_pyspark.artifacts.staging import ArtifactStagingService
from beam_pyspark.artifacts.staging import StagingState
from beam_pyspark.artifacts.staging import UnknownStagingTokenError

__all__ = [
    'ArtifactRetrievalService',
    'ArtifactServiceError',
    'ArtifactStagingError',
    'ArtifactStagingService',
    'StagingState',
    'UnknownStagingTokenError',
]
