//go:build deps

// Package deps names the Beam Go SDK packages this module builds, so that
// `go mod tidy` keeps them: Beam's wordcount example and Beam's Go
// integration test packages (their tests are compiled with `go test -c`).
// The build tag keeps this file out of every build.
package deps

import (
	_ "github.com/apache/beam/sdks/v2/go/examples/wordcount"
	_ "github.com/apache/beam/sdks/v2/go/test/integration/primitives"
	_ "github.com/apache/beam/sdks/v2/go/test/integration/synthetic"
	_ "github.com/apache/beam/sdks/v2/go/test/integration/wordcount"
	_ "github.com/apache/beam/sdks/v2/go/test/regression"
)
