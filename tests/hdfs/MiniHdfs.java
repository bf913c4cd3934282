// A MiniDFSCluster (Apache Hadoop's NameNode and one DataNode in this JVM)
// on 127.0.0.1, for beam_pyspark/local/stores.py (the tests' HDFS and
// `beam-pyspark local hdfs`). Run as a single-file source program:
// java -cp <classpath> MiniHdfs.java BASE_DIR [RPC_PORT HTTP_PORT]
// (ports 0 or none: free ones).
// Prints one JSON line {"rpc": port, "http": port} once it serves, and
// shuts down when its standard input closes (the test process ended).
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.MiniDFSCluster;

public class MiniHdfs {
  public static void main(String[] args) throws Exception {
    Configuration conf = new Configuration();
    conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, args[0]);
    // WebHDFS clients name no user (or another one): no permission checks.
    conf.setBoolean("dfs.permissions.enabled", false);
    conf.setBoolean("dfs.webhdfs.enabled", true);
    conf.setInt("dfs.replication", 1);
    int rpcPort = args.length > 1 ? Integer.parseInt(args[1]) : 0;
    int httpPort = args.length > 2 ? Integer.parseInt(args[2]) : 0;
    // Loopback only.
    conf.set("dfs.namenode.rpc-bind-host", "127.0.0.1");
    conf.set("dfs.namenode.http-bind-host", "127.0.0.1");
    conf.set("dfs.datanode.hostname", "127.0.0.1");
    MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf)
        .numDataNodes(1).nameNodePort(rpcPort).nameNodeHttpPort(httpPort)
        .checkDataNodeHostConfig(true).build();
    cluster.waitActive();
    System.out.println("{\"rpc\": " + cluster.getNameNodePort() + ", \"http\": "
        + cluster.getNameNode().getHttpAddress().getPort() + "}");
    System.out.flush();
    while (System.in.read() != -1) {
    }
    cluster.shutdown();
  }
}
