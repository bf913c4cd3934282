"""Services for trying the docs on one machine: ``beam-pyspark local``.

A Kafka broker (Apache Kafka's own jars), HDFS (Hadoop's MiniDFSCluster),
an S3-compatible store (moto's server) and Beam's Java expansion services
for Beam SQL and KafkaIO, each on loopback, started from a clone of the
repository (the Java ones from the jars its make targets resolve with
Maven). The tests start the same classes as their fixtures.
"""
