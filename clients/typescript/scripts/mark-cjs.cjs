// dist/cjs holds CommonJS while the package is "type": "module": this marker
// makes Node load those files as CommonJS.
require("node:fs").writeFileSync(
  require("node:path").join(__dirname, "..", "dist", "cjs", "package.json"),
  '{ "type": "commonjs" }\n',
);
