package beampyspark.xlang.validates;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.beam.model.pipeline.v1.ExternalTransforms.ExternalConfigurationPayload;
import org.apache.beam.model.pipeline.v1.RunnerApi.FunctionSpec;
import org.apache.beam.sdk.Pipeline;
import org.apache.beam.sdk.coders.RowCoder;
import org.apache.beam.sdk.coders.StringUtf8Coder;
import org.apache.beam.sdk.expansion.service.ExpansionService;
import org.apache.beam.sdk.expansion.service.TransformProvider;
import org.apache.beam.sdk.options.PipelineOptions;
import org.apache.beam.sdk.schemas.Schema;
import org.apache.beam.sdk.schemas.SchemaTranslation;
import org.apache.beam.sdk.transforms.Combine;
import org.apache.beam.sdk.transforms.DoFn;
import org.apache.beam.sdk.transforms.Flatten;
import org.apache.beam.sdk.transforms.GroupByKey;
import org.apache.beam.sdk.transforms.MapElements;
import org.apache.beam.sdk.transforms.PTransform;
import org.apache.beam.sdk.transforms.ParDo;
import org.apache.beam.sdk.transforms.Partition;
import org.apache.beam.sdk.transforms.Sum;
import org.apache.beam.sdk.transforms.View;
import org.apache.beam.sdk.transforms.join.CoGbkResult;
import org.apache.beam.sdk.transforms.join.CoGroupByKey;
import org.apache.beam.sdk.transforms.join.KeyedPCollectionTuple;
import org.apache.beam.sdk.values.KV;
import org.apache.beam.sdk.values.PCollection;
import org.apache.beam.sdk.values.PCollectionList;
import org.apache.beam.sdk.values.PCollectionTuple;
import org.apache.beam.sdk.values.PCollectionView;
import org.apache.beam.sdk.values.Row;
import org.apache.beam.sdk.values.TupleTag;
import org.apache.beam.sdk.values.TupleTagList;
import org.apache.beam.sdk.values.TypeDescriptors;

/**
 * The URNs of Beam's cross-language ValidatesRunner suite ({@code
 * apache_beam.transforms.validate_runner_xlang_test}), each a Java transform doing what the
 * suite's Python side asserts: a ParDo adding a prefix (the payload's {@code data}); a
 * multi-input, multi-output ParDo with a side input; GroupByKey; CoGroupByKey of two keyed
 * inputs; Combine globally and per key (sums); Flatten; Partition into even and odd.
 *
 * <p>Inputs arrive by their Python names ({@code main1}, {@code col1}, ...), outputs leave by
 * the names the suite reads ({@code main}, {@code side}, {@code 0}, {@code 1}).
 */
public class ValidatesRunnerRegistrar implements ExpansionService.ExpansionServiceRegistrar {
  static final String PREFIX = "beam:transforms:xlang:test:prefix";
  static final String MULTI = "beam:transforms:xlang:test:multi";
  static final String GBK = "beam:transforms:xlang:test:gbk";
  static final String CGBK = "beam:transforms:xlang:test:cgbk";
  static final String COMGL = "beam:transforms:xlang:test:comgl";
  static final String COMPK = "beam:transforms:xlang:test:compk";
  static final String FLATTEN = "beam:transforms:xlang:test:flatten";
  static final String PARTITION = "beam:transforms:xlang:test:partition";

  @Override
  public Map<String, TransformProvider> knownTransforms() {
    Map<String, TransformProvider> known = new HashMap<>();
    known.put(PREFIX, new SingleInput() {
      @Override
      public PTransform<PCollection<?>, PCollection<?>> build(FunctionSpec spec) {
        String prefix = payloadString(spec, "data");
        return cast(MapElements.into(TypeDescriptors.strings())
            .via((String element) -> prefix + element));
      }
    });
    known.put(MULTI, new Multi());
    known.put(GBK, new SingleInput() {
      @Override
      public PTransform<PCollection<?>, PCollection<?>> build(FunctionSpec spec) {
        return cast(GroupByKey.<Long, String>create());
      }
    });
    known.put(CGBK, new CoGroup());
    known.put(COMGL, new SingleInput() {
      @Override
      public PTransform<PCollection<?>, PCollection<?>> build(FunctionSpec spec) {
        return cast(Combine.globally(Sum.ofLongs()));
      }
    });
    known.put(COMPK, new SingleInput() {
      @Override
      public PTransform<PCollection<?>, PCollection<?>> build(FunctionSpec spec) {
        return cast(Sum.<String>longsPerKey());
      }
    });
    known.put(FLATTEN, new FlattenAll());
    known.put(PARTITION, new EvenOdd());
    return known;
  }

  /** The payload's string field {@code name} (an ExternalConfigurationPayload's row). */
  static String payloadString(FunctionSpec spec, String name) {
    try {
      ExternalConfigurationPayload payload =
          ExternalConfigurationPayload.parseFrom(spec.getPayload());
      Schema schema = SchemaTranslation.schemaFromProto(payload.getSchema());
      Row row = RowCoder.of(schema).decode(payload.getPayload().newInput());
      return row.getString(name);
    } catch (Exception e) {
      throw new IllegalArgumentException(
          "Cannot read the field '" + name + "' of " + spec.getUrn() + "'s payload", e);
    }
  }

  @SuppressWarnings({"unchecked", "rawtypes"})
  static PTransform<PCollection<?>, PCollection<?>> cast(PTransform transform) {
    return (PTransform<PCollection<?>, PCollection<?>>) transform;
  }

  /** One input PCollection, one output. */
  abstract static class SingleInput
      implements TransformProvider<PCollection<?>, PCollection<?>> {
    abstract PTransform<PCollection<?>, PCollection<?>> build(FunctionSpec spec);

    @Override
    public PTransform<PCollection<?>, PCollection<?>> getTransform(
        FunctionSpec spec, PipelineOptions options) {
      return build(spec);
    }
  }

  /** The inputs as a tuple, each tagged with its Python name. */
  @SuppressWarnings({"unchecked", "rawtypes"})
  static PCollectionTuple byName(Pipeline p, Map<String, PCollection<?>> inputs) {
    PCollectionTuple tuple = PCollectionTuple.empty(p);
    for (Map.Entry<String, PCollection<?>> input : inputs.entrySet()) {
      tuple = tuple.and(new TupleTag(input.getKey()), input.getValue());
    }
    return tuple;
  }

  /** Inputs as a tuple by their names, outputs by their tags' names. */
  abstract static class Named implements TransformProvider<PCollectionTuple, PCollectionTuple> {
    @Override
    public PCollectionTuple createInput(Pipeline p, Map<String, PCollection<?>> inputs) {
      return byName(p, inputs);
    }

    @Override
    public Map<String, PCollection<?>> extractOutputs(PCollectionTuple output) {
      Map<String, PCollection<?>> outputs = new HashMap<>();
      output.getAll().forEach((tag, pc) -> outputs.put(tag.getId(), pc));
      return outputs;
    }
  }

  /** main1 and main2 each with the side input's value appended, to 'main'; the side input's
   * own elements likewise, to 'side': one ParDo with two outputs and a side input. */
  static class Multi extends Named {
    @Override
    public PTransform<PCollectionTuple, PCollectionTuple> getTransform(
        FunctionSpec spec, PipelineOptions options) {
      return new PTransform<PCollectionTuple, PCollectionTuple>() {
        @Override
        public PCollectionTuple expand(PCollectionTuple input) {
          PCollection<String> main1 = input.get("main1");
          PCollection<String> main2 = input.get("main2");
          PCollection<String> side = input.get("side");
          PCollectionView<String> view = side.apply("SideView", View.asSingleton());
          TupleTag<String> mainTag = new TupleTag<>("main");
          TupleTag<String> sideTag = new TupleTag<>("side");
          PCollection<String> mains =
              PCollectionList.of(main1).and(main2).apply("FlattenMains", Flatten.pCollections());
          PCollectionTuple out =
              mains.apply(
                  "AppendSide",
                  ParDo.of(new AppendSide(view))
                      .withSideInputs(view)
                      .withOutputTags(mainTag, TupleTagList.of(sideTag)));
          // A plain tag's coder cannot be inferred (its output is unused).
          out.get(mainTag).setCoder(StringUtf8Coder.of());
          out.get(sideTag).setCoder(StringUtf8Coder.of());
          PCollection<String> sides =
              side.apply("SideWithSide", ParDo.of(new AppendSide(view)).withSideInputs(view));
          return PCollectionTuple.of(mainTag, out.get(mainTag)).and(sideTag, sides);
        }
      };
    }
  }

  /** col1 and col2 cogrouped: each key with all its values, of both. */
  static class CoGroup implements TransformProvider<PCollectionTuple, PCollection<?>> {
    @Override
    public PCollectionTuple createInput(Pipeline p, Map<String, PCollection<?>> inputs) {
      return byName(p, inputs);
    }

    @Override
    public PTransform<PCollectionTuple, PCollection<?>> getTransform(
        FunctionSpec spec, PipelineOptions options) {
      return new PTransform<PCollectionTuple, PCollection<?>>() {
        @Override
        public PCollection<?> expand(PCollectionTuple input) {
          TupleTag<String> tag1 = new TupleTag<>("col1");
          TupleTag<String> tag2 = new TupleTag<>("col2");
          PCollection<KV<Long, String>> col1 = input.get("col1");
          PCollection<KV<Long, String>> col2 = input.get("col2");
          return KeyedPCollectionTuple.of(tag1, col1)
              .and(tag2, col2)
              .apply("CoGroup", CoGroupByKey.create())
              .apply("AllValues", ParDo.of(new AllValues(tag1, tag2)));
        }
      };
    }
  }

  /** Each element with the side input's value appended. */
  static class AppendSide extends DoFn<String, String> {
    private final PCollectionView<String> view;

    AppendSide(PCollectionView<String> view) {
      this.view = view;
    }

    @ProcessElement
    public void process(ProcessContext c) {
      c.output(c.element() + c.sideInput(view));
    }
  }

  /** A key with the values of both tags, as one iterable. */
  static class AllValues extends DoFn<KV<Long, CoGbkResult>, KV<Long, Iterable<String>>> {
    private final TupleTag<String> tag1;
    private final TupleTag<String> tag2;

    AllValues(TupleTag<String> tag1, TupleTag<String> tag2) {
      this.tag1 = tag1;
      this.tag2 = tag2;
    }

    @ProcessElement
    public void process(ProcessContext c) {
      List<String> values = new ArrayList<>();
      c.element().getValue().getAll(tag1).forEach(values::add);
      c.element().getValue().getAll(tag2).forEach(values::add);
      c.output(KV.of(c.element().getKey(), values));
    }
  }

  /** Every input into one PCollection. */
  static class FlattenAll implements TransformProvider<PCollectionList<Long>, PCollection<Long>> {
    @Override
    @SuppressWarnings("unchecked")
    public PCollectionList<Long> createInput(Pipeline p, Map<String, PCollection<?>> inputs) {
      PCollectionList<Long> list = PCollectionList.empty(p);
      for (PCollection<?> input : inputs.values()) {
        list = list.and((PCollection<Long>) input);
      }
      return list;
    }

    @Override
    public PTransform<PCollectionList<Long>, PCollection<Long>> getTransform(
        FunctionSpec spec, PipelineOptions options) {
      return Flatten.pCollections();
    }
  }

  /** Even numbers to output '0', odd to '1'. */
  static class EvenOdd implements TransformProvider<PCollection<Long>, PCollectionList<Long>> {
    @Override
    public PTransform<PCollection<Long>, PCollectionList<Long>> getTransform(
        FunctionSpec spec, PipelineOptions options) {
      return Partition.of(2, (Long element, int n) -> element % 2 == 0 ? 0 : 1);
    }

    @Override
    public Map<String, PCollection<?>> extractOutputs(PCollectionList<Long> output) {
      Map<String, PCollection<?>> outputs = new HashMap<>();
      for (int i = 0; i < output.size(); i++) {
        outputs.put(Integer.toString(i), output.get(i));
      }
      return outputs;
    }
  }
}
