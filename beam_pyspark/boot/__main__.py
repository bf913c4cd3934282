import sys

from beam_pyspark.boot import main

sys.exit(main(sys.argv[1:]))
