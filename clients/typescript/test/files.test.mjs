// A task's files through the client: upload, list, download (whole and ranged), delete, errors.
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { test } from "node:test";

import { isHoldfastError } from "../dist/esm/index.js";
import { client, skip } from "./helpers.mjs";

test("upload, list, download and delete a task's files", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({ message: "hello files" });
  await turn.untilDone();
  const taskId = turn.taskId;
  const data = new Uint8Array(randomBytes(1_200_000));

  const entry = await hf.uploadFile(taskId, "inputs/a dir/data.bin", data);
  assert.equal(entry.size, data.length);
  assert.equal(entry.sha256, createHash("sha256").update(data).digest("hex"));
  await hf.uploadFile(taskId, "notes.txt", "from TypeScript");

  const top = await hf.listFiles(taskId);
  assert.deepEqual(top.files.map((f) => [f.path, f.kind]), [["inputs", "dir"], ["notes.txt", "file"]]);
  const deep = await hf.listFiles(taskId, { path: "inputs", recursive: true });
  assert.deepEqual(deep.files.map((f) => f.path), ["inputs/a dir", "inputs/a dir/data.bin"]);
  assert.equal(deep.files[1].download, `/tasks/${taskId}/files/inputs/a%20dir/data.bin`);

  assert.deepEqual(await hf.downloadFile(taskId, "inputs/a dir/data.bin"), data);
  assert.deepEqual(await hf.downloadFile(taskId, "inputs/a dir/data.bin", { start: 5, end: 14 }), data.slice(5, 15));
  assert.deepEqual(await hf.downloadFile(taskId, "inputs/a dir/data.bin", { end: 3 }), data.slice(-3));
  assert.equal(new TextDecoder().decode(await hf.downloadFile(taskId, "notes.txt")), "from TypeScript");

  await hf.deleteFile(taskId, "inputs");
  assert.deepEqual((await hf.listFiles(taskId)).files.map((f) => f.path), ["notes.txt"]);
  await assert.rejects(hf.downloadFile(taskId, "inputs/a dir/data.bin"), (error) => {
    assert.ok(isHoldfastError(error));
    assert.equal(error.status, 404);
    assert.equal(error.code, "FILE_NOT_FOUND");
    return true;
  });
  await assert.rejects(hf.listFiles(taskId, { path: "../.." }), (error) => {
    assert.equal(error.status, 422);
    assert.equal(error.code, "INVALID_REQUEST");
    return true;
  });
  await hf.deleteTask(taskId);
});
