// A MiniYARNCluster (Apache Hadoop's ResourceManager and one NodeManager in
// this JVM) and a MiniDFSCluster beside it (Spark's YARN client stages the
// application's files on fs.defaultFS, and the NodeManager localizes them
// from there), for tests/test_yarn.py. Run as a single-file source program,
// with this JVM's working directory BASE_DIR (MiniYARNCluster puts its work
// directories under ./target) and JAVA_HOME set (containers start
// $JAVA_HOME/bin/java):
// java -cp <classpath> MiniYarn.java BASE_DIR [NM_MEMORY_MB]
// Writes a Hadoop configuration directory BASE_DIR/conf (core-site.xml,
// hdfs-site.xml, yarn-site.xml with the clusters' real addresses), prints one
// JSON line {"conf_dir": ..., "rm": "host:port", "webapp": "host:port",
// "hdfs": "hdfs://host:port", "webhdfs_port": port}
// once the NodeManager has registered, and shuts down when its standard input
// closes (the test process ended).
import java.io.File;
import java.io.FileOutputStream;
import java.io.OutputStream;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.MiniDFSCluster;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;

public class MiniYarn {
  // The client-side keys: where Spark's YARN client (and its
  // ApplicationMaster) find the ResourceManager.
  static final String[] YARN_CLIENT_KEYS = {
    YarnConfiguration.RM_ADDRESS,
    YarnConfiguration.RM_SCHEDULER_ADDRESS,
    YarnConfiguration.RM_RESOURCE_TRACKER_ADDRESS,
    YarnConfiguration.RM_ADMIN_ADDRESS,
    YarnConfiguration.RM_WEBAPP_ADDRESS,
    YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB,
    YarnConfiguration.RM_SCHEDULER_MAXIMUM_ALLOCATION_MB,
  };

  static void write(Configuration conf, File file) throws Exception {
    try (OutputStream out = new FileOutputStream(file)) {
      conf.writeXml(out);
    }
  }

  public static void main(String[] args) throws Exception {
    try {
      serve(args);
    } catch (Throwable e) {
      // A failed start leaves the MiniDFSCluster's non-daemon threads
      // running: exit, so that the test sees the failure at once.
      e.printStackTrace();
      System.exit(1);
    }
    System.exit(0);
  }

  static void serve(String[] args) throws Exception {
    File base = new File(args[0]).getAbsoluteFile();
    int nmMemoryMb = args.length > 1 ? Integer.parseInt(args[1]) : 4096;

    Configuration dfsConf = new Configuration();
    dfsConf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, new File(base, "dfs").getPath());
    // Spark's client and the NodeManager's localizer name users of their own:
    // no permission checks.
    dfsConf.setBoolean("dfs.permissions.enabled", false);
    dfsConf.setInt("dfs.replication", 1);
    // The runner's Python side reaches HDFS through WebHDFS (Beam's
    // --hdfs_host/--hdfs_port): a streaming job's checkpoint on it.
    dfsConf.setBoolean("dfs.webhdfs.enabled", true);
    dfsConf.set("dfs.namenode.rpc-bind-host", "127.0.0.1");
    dfsConf.set("dfs.namenode.http-bind-host", "127.0.0.1");
    dfsConf.set("dfs.datanode.hostname", "127.0.0.1");
    MiniDFSCluster dfs = new MiniDFSCluster.Builder(dfsConf)
        .numDataNodes(1).checkDataNodeHostConfig(true).build();
    dfs.waitActive();
    String defaultFs = "hdfs://127.0.0.1:" + dfs.getNameNodePort();

    YarnConfiguration conf = new YarnConfiguration();
    conf.set("fs.defaultFS", defaultFs);
    // One NodeManager of modest size: the machine is shared.
    conf.setInt(YarnConfiguration.NM_PMEM_MB, nmMemoryMb);
    conf.setInt(YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB, 256);
    conf.setInt(YarnConfiguration.RM_SCHEDULER_MAXIMUM_ALLOCATION_MB, nmMemoryMb);
    conf.setInt(YarnConfiguration.NM_VCORES, 4);
    // The CapacityScheduler (YARN's default) reads its queues from
    // capacity-scheduler.xml, which no jar here carries: one queue with all of
    // the cluster, and room for the ApplicationMasters of a few applications
    // (the default 10% of 4 GiB admits none of Spark's 1 GiB AM containers
    // after the first).
    conf.set("yarn.scheduler.capacity.root.queues", "default");
    conf.set("yarn.scheduler.capacity.root.default.capacity", "100");
    conf.set("yarn.scheduler.capacity.maximum-am-resource-percent", "0.5");
    // A JVM's virtual size is far above its heap (thread stacks, code cache,
    // mapped jars): the virtual-memory check kills healthy Spark containers,
    // and most clusters turn it off. The physical-memory check stays on.
    conf.setBoolean(YarnConfiguration.NM_VMEM_CHECK_ENABLED, false);
    // A developer's disk may be fuller than the 90% at which the NodeManager
    // declares its directories bad and takes no containers.
    conf.setFloat(
        YarnConfiguration.NM_MAX_PER_DISK_UTILIZATION_PERCENTAGE, 99.5f);
    // Keep finished containers' directories and logs (the test reads the
    // executors' logs; a failure is looked into there): whatever the
    // NodeManager deletes waits this long, and never happens before it
    // stops.
    conf.setInt(YarnConfiguration.DEBUG_NM_DELETE_DELAY_SEC, 600);
    // A stop waited for the log handler's pending deletions (its default
    // retention is 3 hours) for 10 s, and for the applications' clean-up,
    // up to these two plus a second: a stop after an application took 19 s
    // instead of 2. Handed over at once, the deletions wait in the deletion
    // service instead (above), which a stop drops.
    conf.setLong(YarnConfiguration.NM_LOG_RETAIN_SECONDS, 1);
    conf.setLong(YarnConfiguration.NM_PROCESS_KILL_WAIT_MS, 200);
    conf.setLong(YarnConfiguration.NM_SLEEP_DELAY_BEFORE_SIGKILL_MS, 250);

    MiniYARNCluster yarn = new MiniYARNCluster("beam-pyspark-yarn", 1, 1, 1);
    yarn.init(conf);
    yarn.start();
    if (!yarn.waitForNodeManagersToConnect(60_000)) {
      throw new IllegalStateException("the NodeManager did not register within 60 s");
    }

    File confDir = new File(base, "conf");
    confDir.mkdirs();
    Configuration core = new Configuration(false);
    core.set("fs.defaultFS", defaultFs);
    write(core, new File(confDir, "core-site.xml"));
    Configuration hdfsSite = new Configuration(false);
    hdfsSite.setInt("dfs.replication", 1);
    write(hdfsSite, new File(confDir, "hdfs-site.xml"));
    Configuration started = yarn.getConfig();
    Configuration yarnSite = new Configuration(false);
    for (String key : YARN_CLIENT_KEYS) {
      yarnSite.set(key, started.get(key));
    }
    write(yarnSite, new File(confDir, "yarn-site.xml"));

    System.out.println("{\"conf_dir\": \"" + confDir.getPath() + "\", \"rm\": \""
        + started.get(YarnConfiguration.RM_ADDRESS) + "\", \"webapp\": \""
        + started.get(YarnConfiguration.RM_WEBAPP_ADDRESS) + "\", \"hdfs\": \""
        + defaultFs + "\", \"webhdfs_port\": "
        + dfs.getNameNode().getHttpAddress().getPort() + "}");
    System.out.flush();
    while (System.in.read() != -1) {
    }
    yarn.stop();
    dfs.shutdown();
  }
}
