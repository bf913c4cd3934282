package beampyspark.xlang;

import java.util.Collections;
import java.util.Map;
import org.apache.beam.sdk.expansion.ExternalTransformRegistrar;
import org.apache.beam.sdk.extensions.sql.SqlTransform;
import org.apache.beam.sdk.extensions.sql.impl.CalciteQueryPlanner;
import org.apache.beam.sdk.transforms.ExternalTransformBuilder;
import org.apache.beam.sdk.transforms.PTransform;
import org.apache.beam.sdk.values.PCollection;
import org.apache.beam.sdk.values.PInput;
import org.apache.beam.sdk.values.Row;

/**
 * Python's {@code apache_beam.transforms.sql.SqlTransform} expands through the URN
 * {@code beam:external:java:sql:v1}. Beam registers that URN in its SQL expansion service
 * module, which Maven Central does not serve; this registrar maps it to Java's {@link
 * SqlTransform} on the served {@code beam-sdks-java-extensions-sql} jar.
 *
 * <p>The expansion service fills {@link Configuration} through its setters, one for every field
 * of the payload Python sends (query, dialect, ddl as of Beam 2.77): a field with no setter
 * fails the expansion, so each has one.
 */
public class SqlTransformRegistrar implements ExternalTransformRegistrar {
  public static final String URN = "beam:external:java:sql:v1";

  @Override
  public Map<String, Class<? extends ExternalTransformBuilder<?, ?, ?>>> knownBuilders() {
    return Collections.singletonMap(URN, Builder.class);
  }

  /** The payload's fields (snake_case in Python, camelCase setters here). */
  public static class Configuration {
    private String query = "";
    private String dialect;
    private String ddl;

    public void setQuery(String query) {
      this.query = query;
    }

    public void setDialect(String dialect) {
      this.dialect = dialect;
    }

    public void setDdl(String ddl) {
      this.ddl = ddl;
    }
  }

  /** Builds Java's SqlTransform from the configuration. */
  public static class Builder
      implements ExternalTransformBuilder<Configuration, PInput, PCollection<Row>> {
    @Override
    public PTransform<PInput, PCollection<Row>> buildExternal(Configuration config) {
      SqlTransform transform = SqlTransform.query(config.query);
      if (config.dialect != null && !config.dialect.isEmpty()) {
        // ZetaSQL left Beam (its planner is not in the served jars): say so
        // rather than plan the query with another dialect's rules.
        if (!config.dialect.equalsIgnoreCase("calcite")) {
          throw new IllegalArgumentException(
              "SQL dialect '" + config.dialect + "' is not available in this expansion service; "
                  + "the one it has is 'calcite' (the default, dialect=None)");
        }
        transform = transform.withQueryPlannerClass(CalciteQueryPlanner.class);
      }
      if (config.ddl != null && !config.ddl.isEmpty()) {
        transform = transform.withDdlString(config.ddl);
      }
      return transform;
    }
  }
}
