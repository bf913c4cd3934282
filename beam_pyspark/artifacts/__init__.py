"""Artifact staging (Beam's reverse retrieval protocol) and retrieval.

``ArtifactStagingService`` receives a job's artifacts from the client into a
content-addressed directory (and, given a manifest directory, records which
files each job holds, so a restarted server can ``recover()`` them);
``ArtifactRetrievalService`` serves them from there to SDK workers, with URL
artifacts fetched on demand. Imports Beam, gRPC and ``beam_pyspark.errors`` only.
"""

from beam_pyspark.artifacts.retrieval import ArtifactRetrievalService
from beam_pyspark.artifacts.retrieval import ArtifactServiceError
from beam_pyspark.artifacts.retrieval import open_url
from beam_pyspark.artifacts.staging import ArtifactStagingError
from beam_pyspark.artifacts.staging import ArtifactStagingService
from beam_pyspark.artifacts.staging import Recovery
from beam_pyspark.artifacts.staging import StagingState
from beam_pyspark.artifacts.staging import UnknownStagingTokenError

__all__ = [
    'ArtifactRetrievalService',
    'ArtifactServiceError',
    'ArtifactStagingError',
    'ArtifactStagingService',
    'Recovery',
    'StagingState',
    'UnknownStagingTokenError',
    'open_url',
]
